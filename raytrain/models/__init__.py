"""LightningModules used by the bundled jobs in jobs/."""
