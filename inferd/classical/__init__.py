"""The classical (tabular) kind's replica: ONNX, XGBoost, LightGBM and scikit-learn models over the batcher."""
