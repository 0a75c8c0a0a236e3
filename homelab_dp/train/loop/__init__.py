"""The worker's loop: entry, rank set-up, micro-steps and steps, checkpoints, the rank's guard, divergence checks, events and reporting."""
