"""Commands around training that are not the learner loop: reward-model training (`rm_training`,
on `preferences`) and the export of a published version as a Hugging Face model (`export`)."""
