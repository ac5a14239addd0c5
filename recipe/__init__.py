"""CLIP training recipe: sharded contrastive loss, encoders, data and the DeepSpeed train loop."""
