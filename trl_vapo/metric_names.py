"""The names of the logged metrics that more than one module writes or reads (the trainer's rollout metrics, its
value-pretraining stop, the diagnostic plots, the model card, the CLI's summary): written once here."""

REWARD = "reward"
ACCURACY = "accuracy"
VALUE_LOSS = "loss/value"
EXPLAINED_VARIANCE = "value/explained_variance"
POSITION_CORRELATION = "advantages/position_correlation"

# The phases a log's `phase` names.
VALUE_PRETRAIN = "value_pretrain"
RL = "rl"
EVAL = "eval"  # a rollout on eval_dataset: built as RL's, with the policy's log-probs, and never trained on


def value_pretraining_end(log_history) -> int | None:
    """The step value pretraining ended at: its last log's, which it writes at the step it ends (with logging_steps
    above 1, RL's first steps are not value pretraining's); None where it logged none."""
    return max((h["step"] for h in log_history if h.get("phase") == VALUE_PRETRAIN), default=None)
