"""The submission client (the user's process): Ray's Job Submission SDK for raytrain jobs."""
