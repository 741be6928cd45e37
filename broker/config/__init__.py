"""The run configuration every process loads: the root `Config` (`config`), one module per section
(`config_*`), the rules tying sections together (`config_rules`), the fingerprint processes must
agree on (`fingerprint`), GPU placement (`placement`), `model.path` (`model_dir`) and the
process set-up every process runs (`process`)."""
