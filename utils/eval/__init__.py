"""Evaluation: the validation loop, metrics, COCO scoring and checkpoint validation."""
