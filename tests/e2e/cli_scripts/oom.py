"""A user's script that needs more memory than its pod may have: the kernel's OOM killer ends it."""
hog = []
while True:
    hog.append(bytearray(128 * 1024 * 1024))  # zero-filled: every page is touched
