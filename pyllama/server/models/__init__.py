"""Router mode: several models behind one endpoint, each in its own server process (registry: what
models exist; process: one model's server; proxy: a request passed on; front: the router)."""
