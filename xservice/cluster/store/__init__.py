"""The service-side metadata stores: the embedded (in-process) store and the bridge serving it to engines."""
