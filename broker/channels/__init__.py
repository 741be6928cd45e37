"""A run's channels in Redis and the rules on them: the prompts stream and dead letters
(`streams`), the trajectory streams (`trajectories`), the run, weights and heartbeat hashes
(`registry`), the learner's lease (`lease`), who may write (`roster`, `provenance`), lost prompts
(`inflight`), trimming (`retention`), forgotten writes (`audit`) and the check that each
generator serves the version it reports (`serving`)."""
