"""What runs in fit: the AdaptivePrecision callback, and autofit, which adds it by itself."""
