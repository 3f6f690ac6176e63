"""What a server gives under load: the streaming client, server launchers and the serving benchmarks."""
