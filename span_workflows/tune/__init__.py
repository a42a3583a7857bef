"""Making a model span-ready: training data, the span-mode training forward, LoRA tuning."""
