"""A trained model in use: predict (prediction), evaluate (evaluate_saved), where it looks (explain), ONNX export
and runtime (onnx_export, onnx_folder, onnx_classifier), and the page to try it (app).
"""
