"""Making a model span-ready: training data, the span-mode training forward, LoRA tuning."""

#: The span options the span-ready adapter is trained for and served with (recorded with it:
#: engines on the merged model default to them).
TRAINED_OPTIONS = {"attend": "prefix", "link_blocks": 0}
