"""fedskew: federated learning under label skew."""

__version__ = "0.1.0"
