#!/usr/bin/python3
"""Decodes a TensorBoard event file with the real protobuf and CRC-32C libraries, as TensorBoard reads it.

    /usr/bin/python3 tests/tools/read_tfevents.py FILE

Prints one JSON line per record: {"wall_time", "step", "file_version"?, "scalars": {tag: value}}.
Exits 1 with a message on any framing error (length or payload CRC-32C), on a payload that protobuf
refuses, or on one that is not protobuf's own canonical encoding of what it decodes (a wrong field number
or wire type, or a field protobuf does not know, shows up there). Exits 3 when python3-protobuf or
python3-crc32c (Debian's packages) is not installed, saying so.

The messages are TensorBoard's own, built here from their field numbers (tensorflow/core/util/event.proto
and tensorflow/core/framework/summary.proto) because Debian packages neither TensorFlow nor TensorBoard.
"""
import json
import struct
import sys

try:
    import crc32c
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
except ImportError as e:
    print(f"read_tfevents.py: {e}: install Debian's python3-protobuf and python3-crc32c", file=sys.stderr)
    sys.exit(3)

F = descriptor_pb2.FieldDescriptorProto


def add_field(message, name, number, kind, type_name=None, repeated=False, oneof=None):
    f = message.field.add(name=name, number=number, type=kind,
                          label=F.LABEL_REPEATED if repeated else F.LABEL_OPTIONAL)
    if type_name:
        f.type_name = type_name
    if oneof is not None:
        f.oneof_index = oneof


def event_class():
    fd = descriptor_pb2.FileDescriptorProto(name="lt_tensorboard_event.proto", package="tensorflow", syntax="proto3")
    # Summary.Value: tag = 1, oneof value { simple_value = 2; obsolete_old_style_histogram = 3; image = 4;
    # histo = 5; audio = 6; tensor = 8 }, node_name = 7, metadata = 9 (the messages left as bytes).
    summary = fd.message_type.add(name="Summary")
    value = summary.nested_type.add(name="Value")
    value.oneof_decl.add(name="value")
    add_field(value, "node_name", 7, F.TYPE_STRING)
    add_field(value, "tag", 1, F.TYPE_STRING)
    add_field(value, "metadata", 9, F.TYPE_BYTES)
    add_field(value, "simple_value", 2, F.TYPE_FLOAT, oneof=0)
    add_field(value, "obsolete_old_style_histogram", 3, F.TYPE_BYTES, oneof=0)
    add_field(value, "image", 4, F.TYPE_BYTES, oneof=0)
    add_field(value, "histo", 5, F.TYPE_BYTES, oneof=0)
    add_field(value, "audio", 6, F.TYPE_BYTES, oneof=0)
    add_field(value, "tensor", 8, F.TYPE_BYTES, oneof=0)
    add_field(summary, "value", 1, F.TYPE_MESSAGE, ".tensorflow.Summary.Value", repeated=True)
    # Event: wall_time = 1, step = 2, oneof what { file_version = 3; graph_def = 4; summary = 5;
    # log_message = 6; session_log = 7; tagged_run_metadata = 8; meta_graph_def = 9 }, source_metadata = 10.
    event = fd.message_type.add(name="Event")
    event.oneof_decl.add(name="what")
    add_field(event, "wall_time", 1, F.TYPE_DOUBLE)
    add_field(event, "step", 2, F.TYPE_INT64)
    add_field(event, "file_version", 3, F.TYPE_STRING, oneof=0)
    add_field(event, "graph_def", 4, F.TYPE_BYTES, oneof=0)
    add_field(event, "summary", 5, F.TYPE_MESSAGE, ".tensorflow.Summary", oneof=0)
    add_field(event, "log_message", 6, F.TYPE_BYTES, oneof=0)
    add_field(event, "session_log", 7, F.TYPE_BYTES, oneof=0)
    add_field(event, "tagged_run_metadata", 8, F.TYPE_BYTES, oneof=0)
    add_field(event, "meta_graph_def", 9, F.TYPE_BYTES, oneof=0)
    add_field(event, "source_metadata", 10, F.TYPE_BYTES)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fd)
    descriptor = pool.FindMessageTypeByName("tensorflow.Event")
    if hasattr(message_factory, "GetMessageClass"):
        return message_factory.GetMessageClass(descriptor)
    return message_factory.MessageFactory(pool).GetPrototype(descriptor)


def masked_crc(data):
    c = crc32c.crc32c(data)
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def fail(path, offset, what):
    print(f"read_tfevents.py: {path}: record at byte {offset}: {what}", file=sys.stderr)
    sys.exit(1)


def main():
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    path = sys.argv[1]
    Event = event_class()
    data = open(path, "rb").read()
    at = 0
    while at < len(data):
        if len(data) - at < 12:
            fail(path, at, "cut short in its header")
        (length,) = struct.unpack_from("<Q", data, at)
        (length_crc,) = struct.unpack_from("<I", data, at + 8)
        if length_crc != masked_crc(data[at:at + 8]):
            fail(path, at, "the length's CRC-32C does not match")
        if len(data) - at < 16 + length:
            fail(path, at, "cut short in its payload")
        payload = data[at + 12:at + 12 + length]
        (payload_crc,) = struct.unpack_from("<I", data, at + 12 + length)
        if payload_crc != masked_crc(payload):
            fail(path, at, "the payload's CRC-32C does not match")
        event = Event()
        event.ParseFromString(payload)
        if event.SerializeToString(deterministic=True) != payload:
            fail(path, at, "not protobuf's encoding of the Event it decodes to (a field number or wire type is wrong)")
        out = {"wall_time": event.wall_time, "step": event.step}
        what = event.WhichOneof("what")
        if what == "file_version":
            out["file_version"] = event.file_version
        elif what == "summary":
            scalars = {}
            for v in event.summary.value:
                if v.WhichOneof("value") != "simple_value":
                    fail(path, at, f"value {v.tag!r} is not a simple_value")
                scalars[v.tag] = v.simple_value
            out["scalars"] = scalars
        elif what is not None:
            fail(path, at, f"an Event with {what}")
        print(json.dumps(out))
        at += 16 + length


if __name__ == "__main__":
    main()
