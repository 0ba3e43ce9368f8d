"""Graph runners: capture and replay the model forward for fixed batch shapes."""
