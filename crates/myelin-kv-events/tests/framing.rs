//! ZMQ framing tests: live PUB messages, both replay reply shapes (vLLM <=0.25 and >=0.26), the
//! end marker, the replay request, and malformed frame lists.

use myelin_kv_events::decode::REPLAY_END_SEQ;
use myelin_kv_events::{
    AllBlocksCleared, DecodeError, EventBatch, KvEvent, ReplayFrame, WireVersion, decode_live,
    decode_replay, encode_batch, replay_request,
};

fn batch() -> EventBatch {
    EventBatch {
        ts: 12.5,
        events: vec![KvEvent::AllBlocksCleared(AllBlocksCleared)],
        data_parallel_rank: Some(1),
    }
}

fn payload() -> Vec<u8> {
    encode_batch(&batch(), WireVersion::V0_33)
}

#[test]
fn live_message_with_and_without_topic() {
    let seq = 0x0102_0304_0506_0708u64.to_be_bytes();
    for topic in [&b""[..], b"kv@engine-1"] {
        let frames = [topic.to_vec(), seq.to_vec(), payload()];
        let message = decode_live(&frames).unwrap();
        assert_eq!(message.topic, topic);
        assert_eq!(message.seq, 0x0102_0304_0506_0708);
        assert_eq!(message.batch.into_event_batch(), batch());
    }
    // Borrowed frames work too.
    let frames: [&[u8]; 3] = [b"", &seq, &payload()];
    assert_eq!(decode_live(&frames).unwrap().seq, 0x0102_0304_0506_0708);
}

#[test]
fn live_message_errors() {
    let seq = 5u64.to_be_bytes().to_vec();
    let two = [Vec::new(), seq.clone()];
    assert_eq!(
        decode_live(&two),
        Err(DecodeError::FrameCount {
            message: "live KV-event message",
            expected: "3",
            got: 2,
        })
    );
    let four = [Vec::new(), seq.clone(), payload(), Vec::new()];
    assert!(matches!(
        decode_live(&four),
        Err(DecodeError::FrameCount { got: 4, .. })
    ));
    let short_seq = [Vec::new(), vec![0; 7], payload()];
    assert_eq!(
        decode_live(&short_seq),
        Err(DecodeError::SequenceLength { len: 7 })
    );
    let empty_payload = [Vec::new(), seq, Vec::new()];
    assert!(matches!(
        decode_live(&empty_payload),
        Err(DecodeError::Truncated { offset: 0, .. })
    ));
}

#[test]
fn replay_replies_of_both_shapes_and_the_end_marker() {
    let seq = 42u64.to_be_bytes().to_vec();
    let old_shape = [Vec::new(), seq.clone(), payload()];
    let new_shape = [Vec::new(), b"kv@topic".to_vec(), seq, payload()];
    for frames in [&old_shape[..], &new_shape[..]] {
        match decode_replay(frames).unwrap() {
            ReplayFrame::Batch {
                seq,
                batch: decoded,
            } => {
                assert_eq!(seq, 42);
                assert_eq!(decoded.into_event_batch(), batch());
            }
            ReplayFrame::End => panic!("a batch is not the end marker"),
        }
    }
    let end = REPLAY_END_SEQ.to_be_bytes().to_vec();
    assert_eq!(end, vec![0xff; 8]);
    let old_end = [Vec::new(), end.clone(), Vec::new()];
    let new_end = [Vec::new(), Vec::new(), end, Vec::new()];
    assert_eq!(decode_replay(&old_end), Ok(ReplayFrame::End));
    assert_eq!(decode_replay(&new_end), Ok(ReplayFrame::End));
}

#[test]
fn replay_errors() {
    let seq = 1u64.to_be_bytes().to_vec();
    assert!(matches!(
        decode_replay(&[Vec::new(), seq.clone()]),
        Err(DecodeError::FrameCount { got: 2, .. })
    ));
    let five = vec![Vec::new(); 5];
    assert!(matches!(
        decode_replay(&five),
        Err(DecodeError::FrameCount { got: 5, .. })
    ));
    assert_eq!(
        decode_replay(&[b"id".to_vec(), seq.clone(), payload()]),
        Err(DecodeError::ReplayDelimiter { len: 2 })
    );
    assert_eq!(
        decode_replay(&[Vec::new(), vec![0xff; 4], Vec::new()]),
        Err(DecodeError::SequenceLength { len: 4 })
    );
    // A batch payload that is not msgpack.
    assert!(decode_replay(&[Vec::new(), seq, vec![0xc1]]).is_err());
}

#[test]
fn replay_request_is_delimiter_and_big_endian_seq() {
    assert_eq!(
        replay_request(0x0a0b),
        [Vec::new(), vec![0, 0, 0, 0, 0, 0, 0x0a, 0x0b]]
    );
}
