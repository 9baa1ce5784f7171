// How the server answers failures: which exceptions are the client's (4xx) and which the
// server's own (5xx), and a streaming response whose provider throws (it must end the stream
// with an error event and [DONE], abort the request, and never let the exception into httplib).
#include <gtest/gtest.h>
#include <httplib.h>
#include <nlohmann/json.hpp>

#include <new>
#include <stdexcept>
#include <string>

#include "base/error.h"
#include "engine/engine.h"
#include "server/http_server.h"
#include "server/openai_api.h"

namespace spin::server {
namespace {

template <typename E>
ErrorReply reply_to(const E& e) {
  return error_reply(std::make_exception_ptr(e));
}

TEST(ServerErrors, ClientMistakesAre4xxAndServerFailures5xx) {
  const ErrorReply api = reply_to(ApiError(404, "not_found_error", "no such model", "model", "model_not_found"));
  EXPECT_EQ(api.status, 404);
  EXPECT_EQ(api.type, "not_found_error");
  EXPECT_EQ(api.param, "model");
  EXPECT_EQ(api.code, "model_not_found");
  EXPECT_FALSE(api.server_fault());

  const ErrorReply invalid = reply_to(InvalidRequest("the prompt has 40 tokens"));
  EXPECT_EQ(invalid.status, 400);
  EXPECT_EQ(invalid.type, "invalid_request_error");
  EXPECT_EQ(invalid.message, "the prompt has 40 tokens");

  const ErrorReply busy = reply_to(EngineUnavailable("overloaded"));
  EXPECT_EQ(busy.status, 503);
  EXPECT_FALSE(busy.server_fault());
  EXPECT_EQ(reply_to(std::bad_alloc()).status, 503);

  // A spin::Error that is not InvalidRequest comes from the server's own machinery.
  const ErrorReply internal = reply_to(Error("page table corrupt"));
  EXPECT_EQ(internal.status, 500);
  EXPECT_EQ(internal.type, "server_error");
  EXPECT_EQ(internal.message, "page table corrupt");
  EXPECT_TRUE(internal.server_fault());
  EXPECT_EQ(reply_to(std::runtime_error("boom")).status, 500);
  EXPECT_EQ(error_reply(std::make_exception_ptr(42)).status, 500);
}

// A sink recording what a provider writes; `open` says whether the client is still there.
struct RecordingSink {
  httplib::DataSink sink;
  std::string written;
  bool open = true;
  bool done = false;
  RecordingSink() {
    sink.write = [this](const char* data, size_t n) {
      if (!open) return false;
      written.append(data, n);
      return true;
    };
    sink.is_writable = [this] { return open; };
    sink.done = [this] { done = true; };
  }
};

TEST(ServerErrors, AThrowingStreamEndsWithAnErrorEventAndDone) {
  RecordingSink s;
  int aborts = 0;
  const bool keep = run_stream_provider(
      s.sink,
      [&]() -> bool {
        const std::string first = "data: {\"x\":1}\n\n";
        s.sink.write(first.data(), first.size());
        throw Error("logprobs of a token that does not exist");
      },
      [&] { ++aborts; }, "test");
  EXPECT_TRUE(keep);
  EXPECT_EQ(aborts, 1);
  EXPECT_TRUE(s.done);
  const std::string prefix = "data: {\"x\":1}\n\ndata: ";
  ASSERT_EQ(s.written.rfind(prefix, 0), 0u) << s.written;
  const std::string tail = "\n\ndata: [DONE]\n\n";
  ASSERT_GE(s.written.size(), prefix.size() + tail.size());
  EXPECT_EQ(s.written.substr(s.written.size() - tail.size()), tail);
  const auto error = nlohmann::json::parse(
      s.written.substr(prefix.size(), s.written.size() - prefix.size() - tail.size()));
  EXPECT_EQ(error["error"]["type"], "server_error");
  EXPECT_EQ(error["error"]["message"], "logprobs of a token that does not exist");
}

TEST(ServerErrors, AThrowingStreamWithTheClientGoneDropsTheConnection) {
  RecordingSink s;
  s.open = false;
  int aborts = 0;
  EXPECT_FALSE(run_stream_provider(s.sink, []() -> bool { throw std::bad_alloc(); }, [&] { ++aborts; }, "test"));
  EXPECT_EQ(aborts, 1);
  EXPECT_TRUE(s.written.empty());
  EXPECT_FALSE(s.done);
}

TEST(ServerErrors, AStreamThatDoesNotThrowIsPassedThrough) {
  RecordingSink s;
  int aborts = 0;
  EXPECT_FALSE(run_stream_provider(s.sink, [] { return false; }, [&] { ++aborts; }, "test"));
  EXPECT_TRUE(run_stream_provider(s.sink, [] { return true; }, [&] { ++aborts; }, "test"));
  EXPECT_EQ(aborts, 0);
  EXPECT_TRUE(s.written.empty());
}

}  // namespace
}  // namespace spin::server
