"""YOLOv5 networks: building blocks, detection/segmentation heads, model assembly (build_model) and AutoAnchor."""
