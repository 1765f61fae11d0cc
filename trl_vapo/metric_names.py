"""The names of the logged metrics that more than one module writes or reads (the trainer's rollout metrics, its
value-pretraining stop, the diagnostic plots, the model card, the CLI's summary): written once here."""

REWARD = "reward"
ACCURACY = "accuracy"
VALUE_LOSS = "loss/value"
EXPLAINED_VARIANCE = "value/explained_variance"
POSITION_CORRELATION = "advantages/position_correlation"
