"""gaussify: Gaussian approximate inference for deep learning."""
