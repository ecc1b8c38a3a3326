"""The Jupyter server side: extension app, provisioner, handlers, events and directive listener."""
