"""Run planning: stages, options and data checked and a ``RunPlan`` built, before anything runs."""
