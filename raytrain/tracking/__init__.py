"""Run records on the driver: MLflow (runs, params, metrics, the model), the model's input
example, and ``raytrain report``."""
