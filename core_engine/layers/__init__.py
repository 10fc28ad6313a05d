"""Building blocks shared by the model families, one layer a file."""
