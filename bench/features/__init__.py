"""What an engine feature or policy costs or gives, on against off, in one run."""
