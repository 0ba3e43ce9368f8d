"""Request handling shared by the routers: prompts, sampling params, generation, streaming."""
