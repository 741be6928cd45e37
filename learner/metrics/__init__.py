"""What the learner measures and watches: the one metrics sink (`metrics`, with `trackers`), the
reduction over micro-batches, updates and ranks (`metric_sums`), completions and length-bias
metrics (`completions`, `lengths`), the run's summary figures (`history`), learning health
(`health`), the reward-hacking guards (`guards`) and the train-inference mismatch per generator
(`mismatch`)."""
