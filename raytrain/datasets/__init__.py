"""Datasets the bundled jobs write for themselves from data that ships with packages."""
