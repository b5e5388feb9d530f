"""Ties into Keras: step functions, optimizer set-up, loss scales, switching, the rescues."""
