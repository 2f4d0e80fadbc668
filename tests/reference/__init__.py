"""Independent reference implementations (PyTorch / NumPy) the native engine is tested against."""
