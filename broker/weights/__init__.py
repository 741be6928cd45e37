"""The versioned weight store (`weights`) and how a version travels: its manifest and digests
(`manifest`, `digest`, `safetensors_stream`), its notification (`notify`), versions written as
deltas against the one before (`delta`, `delta_write`, `delta_apply`, `manifest_delta`) and read
along the cheapest plan (`weight_path`, `weight_chain`), the probe that proves what a generator
serves (`probe`) and, with `weights.transport: http`, the server, client, plan and chunked reading
(`weight_server`, `weight_client`, `weight_plan`, `weight_sources`, `weight_stream`,
`weight_auth`)."""
