"""The simulated fleet (``dsec fleet simulate``): thousands of signed, heartbeating nodes."""
