"""One learner step: a StepBatch from the step's groups (`batch`, `prepare`), its micro-batches
trained by `train` with the losses of `losses` (the math is algos/'s), the typed slices of the
config the step reads (`step_spec`), log-probabilities (`logprobs`, `packing`), the algorithm's
other models (`reference`, `critic`), the group filters (`filters`) and batch-wide statistics
over the ranks (`global_stats`)."""
