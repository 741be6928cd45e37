"""The models the learner trains and how they are built: the policy (`policy`, `load`, LoRA in
`lora`, `dropout`), whether training fits the GPU (`memory`), the learning-rate schedule
(`schedule`) and the stand-in policy of the scheduling benchmarks (`simulated`)."""
