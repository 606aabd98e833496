"""Answers to reads of values that fake tensors do not hold.

Input: an op whose output depends on values (a mask count, a length, boxes, an optimizer's
step count) and what the user declared.  Output: the value or the bound it takes, with the
note the report shows.  Knows nothing of the step driver or the engines.
"""
