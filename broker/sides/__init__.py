"""The two sides of the broker: what a learner rank does with Redis (`learner_side`) and what a
generator does (`generator_side`), each nothing of the other's."""
