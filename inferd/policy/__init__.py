"""The robot-policy kind's model side: the network and its file format, the simulated task, training."""
