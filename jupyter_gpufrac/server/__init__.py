"""The Jupyter server side: extension app, kernels' GPU state, provisioner, handlers, events, directives."""
