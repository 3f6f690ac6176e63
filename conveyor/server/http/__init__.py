"""What every request passes before the app: the API key, header and body limits, JSON depth, work moved off the event loop."""
