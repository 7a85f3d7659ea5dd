"""Inference on new inputs (detect.py, segment/predict.py): sources, the prediction loop, drawing and saving."""
