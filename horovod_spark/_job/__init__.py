"""The job machinery: launch, watch and fail a job on Spark or on this machine."""
