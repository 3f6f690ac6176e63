"""OpenAI's Responses API: the routes and their streaming events, the request and response models, stored responses."""
