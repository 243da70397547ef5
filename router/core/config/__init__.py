"""Configuration: the settings and their checks, tenants and their keys, the engines' paths, model cards."""
