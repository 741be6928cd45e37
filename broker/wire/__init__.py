"""What crosses a process boundary as bytes: the wire schema (`schema`) and its bounded decoding
(`wire`, `scalars`, `sample_ranges`, `turns`), and what a reward model reads (`rm_input`)."""
