"""The mesh axis names: every collective, partition spec and mesh in glm_dsa/ and sharding/ names its axes here."""

TP = "tp"  # tensor parallel: heads and MLP widths; size TP // DCP
DCP = "dcp"  # decode context parallel: KV tokens of a DCP group; size DCP
TP_AXES = (TP, DCP)  # heads and MLP widths are split over every tensor-parallel device: both axes
