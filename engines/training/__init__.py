"""What every trainer shares: device and precision, collectives, the step loop, schedules, checkpoints."""
