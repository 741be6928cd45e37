"""Held-out evaluation between steps, on the learner's own weights: which items and where
(`evaluator`), greedy and sampled accuracy (`eval_generate`), an agent program's episodes
(`agent_eval`), the evaluation of a step (`heldout`) and the best version kept (`best`)."""
