"""The data pipeline: image and label files -> augmented, cached, sharded batches."""
