"""Tools around the engine: the demo, the offline estimator and the serving benchmark."""
