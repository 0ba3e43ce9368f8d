"""HTTP routers, one per API feature; ``app.build_app`` includes them all."""
