#!/usr/bin/python3
"""A camera for the RTSP tests: GStreamer's RTSP server (gst-rtsp-server, Debian's
gir1.2-gst-rtsp-server-1.0) serving H.264 video and Opus audio at rtsp://<address>:<port>/cam
(usage: camera.py <port> [fps] [address, 127.0.0.1 by default] [video bit rate, bit/s; a
noisy picture when given, so the encoder reaches it]),
one shared pipeline for every client. Prints `ready` when it listens, `client <n>` each time a
client connects and `closed <n>` when its connection closes, so a test can count the upstream
sessions it saw. With CAMERA_AUTH=<user>:<password>:<basic|digest> in the environment it
asks every client for those credentials by that method. With CAMERA_SOURCE=<rtsp URL> it is
not a camera but gst-rtsp-server restreaming that URL (the benchmark's anchor): its H.264 and
Opus depayloaded and payloaded again, one pull for every client."""
import os
import sys

import gi

gi.require_version("Gst", "1.0")
gi.require_version("GstRtspServer", "1.0")
gi.require_version("GstRtsp", "1.0")
from gi.repository import GLib, Gst, GstRtsp, GstRtspServer  # noqa: E402

port = sys.argv[1]
fps = int(sys.argv[2]) if len(sys.argv) > 2 else 25
address = sys.argv[3] if len(sys.argv) > 3 else "127.0.0.1"
bitrate = int(sys.argv[4]) if len(sys.argv) > 4 else None
picture = "pattern=snow" if bitrate else "pattern=ball"
encoder = f"openh264enc gop-size={fps}" + (" rate-control=off" if bitrate else "")
Gst.init(None)
server = GstRtspServer.RTSPServer()
server.set_address(address)
server.set_service(port)
factory = GstRtspServer.RTSPMediaFactory()
launch = (
    f"( videotestsrc is-live=true {picture} ! video/x-raw,width=320,height=240,framerate={fps}/1 "
    f"! {encoder} ! h264parse config-interval=-1 ! rtph264pay name=pay0 pt=96 "
    "audiotestsrc is-live=true ! audio/x-raw,rate=48000,channels=2 ! opusenc ! rtpopuspay name=pay1 pt=97 )"
)
if os.environ.get("CAMERA_SOURCE"):
    launch = (
        f"( rtspsrc location={os.environ['CAMERA_SOURCE']} latency=0 protocols=udp name=src "
        "src. ! application/x-rtp,media=video ! rtph264depay ! h264parse config-interval=-1 ! rtph264pay name=pay0 pt=96 "
        "src. ! application/x-rtp,media=audio ! rtpopusdepay ! rtpopuspay name=pay1 pt=97 )"
    )
factory.set_launch(launch)
factory.set_shared(True)
if os.environ.get("CAMERA_AUTH"):
    user, password, method = os.environ["CAMERA_AUTH"].split(":")
    auth = GstRtspServer.RTSPAuth()
    token = GstRtspServer.RTSPToken()
    token.set_string("media.factory.role", "viewer")
    if method == "digest":
        auth.add_digest(user, password, token)
        auth.set_supported_methods(GstRtsp.RTSPAuthMethod.DIGEST)
    else:
        auth.add_basic(GstRtspServer.RTSPAuth.make_basic(user, password), token)
    server.set_auth(auth)
    permissions = GstRtspServer.RTSPPermissions()
    permissions.add_permission_for_role("viewer", "media.factory.access", True)
    permissions.add_permission_for_role("viewer", "media.factory.construct", True)
    factory.set_permissions(permissions)
server.get_mount_points().add_factory("/cam", factory)
clients = 0


def on_client(_server, client):
    global clients
    clients += 1
    n = clients
    print(f"client {n}", flush=True)
    client.connect("closed", lambda _c: print(f"closed {n}", flush=True))


server.connect("client-connected", on_client)
if server.attach(None) == 0:
    sys.exit(f"cannot listen on {port}")
print("ready", flush=True)
GLib.MainLoop().run()
