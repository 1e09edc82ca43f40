"""What every server process runs around its work: settings (file, environment, flags), logging and the
event loop, liveness and readiness."""
